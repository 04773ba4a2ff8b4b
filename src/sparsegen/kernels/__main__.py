"""`python -m sparsegen.kernels`: build every C++ kernel source for this machine now (cached)."""

from sparsegen.kernels.build import build_all

build_all()
