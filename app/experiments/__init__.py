"""The credit experiment as a pre-registered protocol and its cells (`casi experiment …`).

One module per idea, each importing only the ones below it in this list (the order a cell's
path reads, from the CLI down):

- `schedule` — which planned cell runs next and when (``--stop-by``), and `casi experiment
  status`: what is in, what is left, which machines can run it;
- `aggregate` — every committed cell of a results folder turned into the answer (per mode, per
  seed, every pre-registered hypothesis); `render` draws it (``table.md``, ``ndcg.png``);
- `results_folder` — a protocol's results folder, read and checked file by file (the one reader
  the aggregate and the status share);
- `cell` — run one cell (train from the pinned start, evaluate, write its file), its lock and
  its pins; it calls `app.training` and nothing here above it;
- `start` — the warm start a protocol's recipe names, pinned by its weight hash, made here or
  imported;
- `protocol` — the protocol file: load, validate every key, the environments and hypotheses;
- `protocol_keys` — its rule tables (one rule per key of each TOML table, the limits they name)
  and the reader that checks a table against them;
- `result_file` — one result file: its name, how it is written and read, what it must hold.
"""
