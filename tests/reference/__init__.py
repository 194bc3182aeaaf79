"""Reference code kept only as the tests' oracles: the torch versions of what the decoder runs
on the host (numpy, numba). Tests import it as ``reference.*`` (tests/ is on ``sys.path``
through tests/conftest.py); redraft itself never does."""
