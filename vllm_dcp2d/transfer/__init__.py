"""The KV transfer system: moving a request's pages from prefill ranks to decode ranks.

It imports nothing from vLLM and nothing from ``vllm_dcp2d.connector``
(tests/transfer/test_boundaries.py checks both): the connector (the vLLM glue)
drives it through ``Sender`` (prefill) and ``Receiver`` (decode), and the tests
drive the same objects without an engine.
"""
