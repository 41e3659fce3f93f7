"""Helpers shared by the tests, the check scripts and the benchmarks (never part of the installed package).

* :mod:`tests.support.models`: small models (``TwoHalves``, ``TinyEncoder``,
  a Llama-shaped decoder);
* :mod:`tests.support.meters`: peak memory over a baseline, model state by kind;
* :mod:`tests.support.exits`: counts aborts at interpreter exit of repeated 2-rank runs;
* :mod:`tests.support.faults`: kills a checkpoint save part-way (torn-checkpoint tests).

Imported as ``tests.support.x`` with the repository root on ``sys.path``
(pytest: ``pythonpath = .`` in ``setup.cfg``; the benchmarks and the check
scripts insert it themselves).
"""
