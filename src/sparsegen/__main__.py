"""`python -m sparsegen ...` (as `torchrun -m sparsegen ...` runs it): the `sparsegen` command."""

from sparsegen.cli import main

main()
