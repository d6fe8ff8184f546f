"""CASI's per-action credit inside trainers that are not CASI's: TRL and verl.

Read `casi_integrations.credit` first (`CasiCredit`: the credit source, the queries, m, the
shaping and the parser both adapters share), then `trl` (`CasiGRPOTrainer`) or `verl` (the
`casi` advantage estimator and its reward side; `verl_trainer`: verl's default trainer with that
reward side in its advantage step). The math is `policy.credit_api`, the one entry
point `casi train` runs too; this package only parses, wires and converts.

This package sits above `app` (docs/design.md §2): building CASI's environment from a BEIR folder
is composition from settings (`app.runtime`), so an adapter may import `app`, `policy` and
`evaluator`, and none of them imports it. TRL and verl are imported only by their own modules,
each installed by its own extra or environment (`pip install -e '.[trl]'`, `make verl-env`).
"""
