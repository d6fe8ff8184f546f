"""Background workers of the API process: the rewrite batcher's generation thread
(`batcher`) and the job runners that start `casi train` / `casi audit run` in their own
processes (`jobs`, `audit_jobs`)."""
