"""Training orchestration, run by the CLI (and by the API's job processes): a training run
(`train`), one debug step (`step`), the credit-mode experiment (`experiment`, with its
`experiment_plan`, `experiment_results` and `experiment_tables`), held-out evaluation
(`evaluate`), the experiment trackers of `--report-to` (`trackers`), which queries train /
validate / report (`splits`), resolving and loading a policy reference (`policy_loader`), the
format warm start and LoRA merge (`warmstart`), the surrogate scorer's fit (`surrogate`), and
the where-credits-differ measurement (`credit_report`)."""
