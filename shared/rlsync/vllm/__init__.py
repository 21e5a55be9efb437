"""vLLM integration: the ``bucket`` weight-transfer backend and the worker extension.

``pip install rlsync[vllm]`` is all a vLLM server needs: the ``vllm.general_plugins`` entry point
(:func:`rlsync.vllm.plugin.register`) makes ``--weight-transfer-config '{"backend": "bucket"}'``
known to ``vllm serve``. Nothing here is imported by ``import rlsync``.
"""
