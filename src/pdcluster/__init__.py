"""pdcluster: prefill/decode-disaggregated LLM inference on Kubernetes."""

__version__ = "0.1.0"
