"""The benchmark lab: peer comparisons, sweeps, figures and the page they make.

It runs from a checkout only (`python -m benchmarks.<name>` at the repository root, which puts
this folder and testkit/, the fixtures it shares with the tests, on the import path) and is
not part of the installed package; what an installed user runs (`loraplex bench serve`) is
`loraplex.bench`. benchmarks/README.md lists every script.
"""
