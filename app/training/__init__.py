"""Training orchestration, run by the CLI (and by the API's job processes): a training run
(`train`), one debug step (`step`), the credit-mode experiment (`experiment`, its results and
tables), held-out evaluation (`evaluate`), which queries train / validate / report (`splits`),
resolving and loading a policy reference (`policy_loader`), and the where-credits-differ
measurement (`credit_report`)."""
