"""`python -m benchmarks.peers`: the same as `python -m benchmarks.peers.compare`."""

from benchmarks.peers.compare import main

main()
