"""The local Hub stand-in: :mod:`.server` (bucket API, Xet storage, rate limits) and :mod:`.events` (the events feed)."""
