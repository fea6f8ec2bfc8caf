"""pdcluster.worker.engine: an LLM engine in nano-vllm's shape, one idea per file.

Model config and loader (HF folders, safetensors), the decoder, the paged KV cache and its block manager,
the continuous-batching scheduler with swap/recompute preemption, the sampler, the tokenizer, `LLMEngine`
(synchronous core) and `AsyncEngine` (one background thread, async streams), and the engine's KV
connector interface that disaggregation plugs into.

Must not: import HTTP frameworks, `pdcluster.worker.api`/`server`/`router`, or any transfer backend (the
backends implement the engine's connector interface, not the reverse). Importing this package itself
must stay torch-free; its modules import torch.
"""
