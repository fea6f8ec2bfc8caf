"""pdcluster.kernels.cpu: C++ CPU kernels (AVX-512), built at first use and optional.

Each kernel has a torch path beside it; `native.load` returns None wherever a build is not possible (no
compiler, no AVX-512, `PDCLUSTER_NATIVE_KERNELS=0`), and callers then take the torch path. Callers outside
`pdcluster.kernels` go through `pdcluster.kernels.native`, never this folder (tests/test_layout.py).
"""
