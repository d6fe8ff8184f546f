"""Training orchestration, run by the CLI (and by the API's job processes): a training run
(`train`, its record and lifecycle in `runs`), one debug step (`step`), held-out evaluation
(`evaluate`), the experiment trackers of `--report-to` (`trackers`), which queries train /
validate / report (`splits`), resolving and loading a policy reference (`policy_loader`), the
format warm start and LoRA merge (`warmstart`), moving a policy version between machines
(`portable`) and the surrogate scorer's fit (`surrogate`). The pre-registered experiment that
runs many trainings is `app.experiments`; the where-credits-differ measurement is
`app.services.credit_report`."""
