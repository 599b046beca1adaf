"""vLLM general-plugin entry point (placeholder, filled in by the connector)."""


def register() -> None:
    return None
