"""Reports a person reads: run curves and summaries (`run`), evaluator-agreement audits."""
