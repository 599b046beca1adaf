"""The KV connector: DCP2DConnector and the transfer path behind it.

The connector's name, as users write it in ``--kv-transfer-config``, lives here,
in a module that imports nothing, so the plugin entry point and the vLLM glue can
both name it without importing each other.
"""

CONNECTOR_NAME = "DCP2DConnector"
CONNECTOR_CLASS = ("vllm_dcp2d.connector.connector", "DCP2DConnector")  # module, class, for vLLM's factory
