"""Tensor parallelism: which rank owns which heads, and (later) the process group and the sharded step."""
