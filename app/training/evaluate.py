"""The `casi eval` service: held-out retrieval of a policy version, stored in the database.

Read :func:`evaluate_and_store`. `build_eval_request` (`held_out_request` from a training
config) fixes WHAT is measured (the first N queries of a split; the credit game's executor,
``retrieval.executor``, whose depth, merge rule and rrf_k fuse the nDCG@10 lists as the game
and ``POST /v1/rewrites`` fuse them; a depth-100 executor of the same retriever for the
recall@100 lists; the replay scorers) once, so every evaluation of a run — and `casi eval`
afterwards — measures the same thing. :func:`write_trec_run` writes the lists an evaluation
scored as a TREC run file (`casi eval --run-file`), for trec_eval and other tools.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import platform
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sqlalchemy.orm import Session, sessionmaker

from app.db import repositories as repo
from app.db import session_scope
from app.runtime import Retrieval
from app.training.splits import qrels_split, split_ids
from evaluator.artifacts import FILE_MODE
from evaluator.feedback import FeedbackContext
from evaluator.limits import MAX_PLAYERS
from evaluator.scorers import SetScorer, make_scorer
from evaluator.scorers.qrels import QrelsTable
from policy.evaluate import LISTS, EvalConfig, EvalResult, PoolEval, evaluate_policy
from policy.rollout import RolloutConfig
from policy.train_config import TrainConfig

RECALL_DEPTH = 100


@dataclass
class EvalRequest:
    """What a held-out evaluation measures (built once per run)."""

    split: str
    queries: list[tuple[str, str]]
    executor: Any  # ActionExecutor of the credit game (its depth, merge rule, rrf_k)
    recall_executor: Any  # the same retriever at depth ≥ RECALL_DEPTH
    ndcg: SetScorer
    recall: SetScorer
    config: EvalConfig
    pool: PoolEval | None = None  # the pooled game's extras (its executor merges by pool)
    feedback: FeedbackContext | None = None  # the game's context builder (feedback prompt)

    def describe(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "n_queries": len(self.queries),
            **dataclasses.asdict(self.config),
            "game_depth": self.executor.k,  # how the nDCG lists were fused
            "merge": self.executor.merge,
            "rrf_k": self.executor.rrf_k,
            **({"budget_depth": self.pool.budget_executor.k} if self.pool else {}),
        }


def build_eval_request(
    retrieval: Retrieval, split: str, n_queries: int, config: EvalConfig
) -> EvalRequest:
    """The first ``n_queries`` judged queries of ``split`` (file order: deterministic)."""
    ids = split_ids(retrieval.dataset, split)
    if n_queries < 1:
        raise ValueError(f"--queries must be >= 1, got {n_queries}")
    if len(ids) < n_queries:
        raise ValueError(f"split {split!r} has {len(ids)} judged queries; asked for {n_queries}")
    ids = ids[:n_queries]
    qrels = retrieval.dataset.qrels_rows(qrels_split(split, retrieval.dataset))
    queries = [(q, retrieval.dataset.queries[q]) for q in ids]
    pooled = retrieval.executor.merge == "pool"
    feedback = retrieval.feedback() if pooled or config.rollout.needs_context else None
    return EvalRequest(
        split=split,
        queries=queries,
        executor=retrieval.executor,
        recall_executor=retrieval.executor_at(RECALL_DEPTH),
        ndcg=make_scorer("replay", qrels=qrels, k=config.k_ndcg),
        recall=make_scorer("replay", qrels=qrels, k=config.k_recall, metric="recall"),
        config=config,
        pool=pool_eval(retrieval, queries, qrels, config.rollout.n_actions) if pooled else None,
        feedback=feedback if config.rollout.needs_context else None,
    )


def pool_eval(
    retrieval: Retrieval,
    queries: Sequence[tuple[str, str]],
    qrels: dict[str, dict[int, int]],
    n_actions: int,
) -> PoolEval:
    """The pooled game's held-out extras for ``queries``: graded recall of a whole pool, the
    equal-budget executor (depth (m + 1)·k) and the keyword-expansion rewrites of each query
    (from the top documents of its own list)."""
    k = retrieval.executor.k
    teacher = retrieval.feedback().teacher([t for _, t in queries], n_actions)
    return PoolEval(
        scorer=make_scorer("replay", qrels=qrels, k=(MAX_PLAYERS + 1) * k, metric="graded_recall"),
        qrels=QrelsTable.from_dict(qrels),
        budget_executor=retrieval.executor_at((n_actions + 1) * k),
        baseline=teacher,
        reranker=retrieval.reranker(),
    )


def held_out_request(
    retrieval: Retrieval, rollout: RolloutConfig, split: str, n_queries: int,
    refuse_degenerate: bool = False,
) -> EvalRequest:  # fmt: skip
    """The held-out request of a rollout shape (a training config's ``rollout``, or `casi eval`'s
    options): its m, format, line cap, length cap and prompt; greedy float32 whatever the
    training sampler's precision (the one held-out path). ``refuse_degenerate``: decode with
    serving's degenerate guard (`casi eval --refuse-degenerate`)."""
    config = EvalConfig(rollout=rollout, refuse_degenerate=refuse_degenerate)
    return build_eval_request(retrieval, split, n_queries, config)


def run_request(retrieval: Retrieval, cfg: TrainConfig) -> EvalRequest:
    """The held-out request of a training run (`casi train`): its ``eval`` section (split,
    claims, the degenerate guard) on its rollout shape."""
    held = cfg.eval
    return held_out_request(
        retrieval, cfg.rollout, held.split, held.queries, held.refuse_degenerate
    )


ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "neon", "sve")
"""The CPU flags :func:`machine_info` keeps (the ones that change float kernels)."""

KERNEL_ENV = (
    "LD_PRELOAD", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE", "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
)  # fmt: skip
"""Environment variables that change which float kernels run on the same CPU (MKL's code path,
ATen's and oneDNN's ISA, a library preloaded in front of them): :func:`machine_info` records
the ones set, since on one machine they change float32 products' last bits."""


@functools.cache
def machine_info() -> dict[str, Any]:
    """The CPU model, its family / model / stepping numbers and its ISA flags (/proc/cpuinfo),
    core count, the kernel set torch dispatches to and the :data:`KERNEL_ENV` variables set:
    recorded with every evaluation and experiment (float results can differ between machines in
    the last bits, between two machines whose model names and flags agree but whose
    microarchitectures do not, and on one machine between two kernel settings)."""
    model, flags = platform.processor() or platform.machine(), list[str]()
    ids: dict[str, str] = {}
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and value.strip():
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = sorted(f for f in value.split() if f.startswith(ISA_PREFIXES))
        elif key in ("vendor_id", "cpu family", "model", "stepping") and key not in ids:
            ids[key] = value.strip()
    family = (
        f"{ids.get('vendor_id', '?')} family {ids['cpu family']} model {ids.get('model', '?')} "
        f"stepping {ids.get('stepping', '?')}"
        if "cpu family" in ids
        else None
    )  # e.g. "GenuineIntel family 6 model 167 stepping 1"
    return {
        "cpu_model": model, "cpu_family": family, "isa_flags": flags, "cpu_count": os.cpu_count(),
        "arch": platform.machine(), "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "kernel_env": {k: os.environ[k] for k in KERNEL_ENV if os.environ.get(k)},
    }  # fmt: skip


def short_family(text: str | None) -> str:
    """A `machine_info` CPU family for a table: ``AuthenticAMD family 25 model 17 stepping 1``
    → ``AMD family 25 model 17`` (the stepping never separated two starts)."""
    if text is None or text == "None":  # a cell written before cells recorded the family
        return "(not recorded)"
    short = text.replace("AuthenticAMD", "AMD").replace("GenuineIntel", "Intel")
    return short.split(" stepping ")[0]


def evaluate_request(model: Any, tokenizer: Any, request: EvalRequest) -> EvalResult:
    """The held-out evaluation ``request`` fixes, of ``model`` (greedy float32), not stored."""
    return evaluate_policy(
        model,
        tokenizer,
        request.queries,
        request.executor,
        request.ndcg,
        request.recall,
        request.config,
        recall_executor=request.recall_executor,
        pool=request.pool,
        feedback=request.feedback.contexts if request.feedback is not None else None,
    )


def evaluate_and_store(
    factory: sessionmaker[Session],
    model: Any,
    tokenizer: Any,
    request: EvalRequest,
    *,
    policy_version_id: int | None,
    run_id: int | None = None,
    step: int | None = None,
    register: Callable[[dict[str, float]], int] | None = None,
) -> EvalResult:
    """Evaluate, then store the result against ``policy_version_id`` (or the id ``register``
    returns once the metrics are known: a training run checkpoints the weights it evaluated)."""
    result = evaluate_request(model, tokenizer, request)
    pv_id = register(result.metrics) if register is not None else policy_version_id
    if pv_id is None:
        raise ValueError("an evaluation must belong to a registered policy version")
    with session_scope(factory) as session:
        repo.add_evaluation(
            session, policy_version_id=pv_id, split=request.split, n_queries=result.n_queries,
            metrics=result.metrics, config={**request.describe(), "machine": machine_info()},
            run_id=run_id, step=step,
        )  # fmt: skip
    return result


def run_tags(config: EvalConfig) -> dict[str, tuple[str, int]]:
    """TREC run tag → (the :attr:`EvalResult.lists` key, the list's index in ``LISTS``).

    ``query`` / ``rewrites`` / ``combined``: the lists nDCG@k_ndcg is computed on (the game's
    fusion of depth-retrieval_k lists, cut to k_ndcg; ``combined`` is the list CASI serves);
    ``<name>-<k_recall>``: the depth-k_recall fusions recall@k_recall is computed on (under
    ``rrf`` their top k_ndcg can differ from the served lists)."""
    tags = {name: ("ndcg", i) for i, name in enumerate(LISTS)}
    tags.update({f"{name}-{config.k_recall}": ("recall", i) for i, name in enumerate(LISTS)})
    return tags


def trec_run_lines(result: EvalResult, doc_ids: Sequence[str], config: EvalConfig) -> Iterator[str]:
    """``qid Q0 docid rank score tag`` lines, one per listed document: tag by tag (:func:`run_tags`),
    queries in evaluation order, rank from 1. The score is the fused score (float32, as the
    fusion computes it); a tie with the line above is lowered by one float32 ulp, so the scores
    strictly descend in single precision — trec_eval reads scores as C floats, re-sorts by them
    and breaks ties by document id, and so reads CASI's order. An empty list (a query without
    rewrites, or no document found) writes no line."""
    qids = [str(row["query_id"]) for row in result.per_query]
    for name in [*qids, *doc_ids]:
        if not name or any(c.isspace() for c in name):
            raise ValueError(f"id {name!r} cannot be written to a TREC run file (whitespace)")
    down = np.float32(-np.inf)
    for tag, (key, i) in run_tags(config).items():
        lists = result.lists[key]
        for q, qid in enumerate(qids):
            previous = np.float32(np.inf)
            rows = lists.rows[q, i].tolist()
            scores = lists.scores[q, i].to(torch.float32).numpy()
            for rank, (row, score) in enumerate(zip(rows, scores, strict=True), start=1):
                if row < 0:  # padding is always at the end of a list
                    break
                written = min(np.float32(score), np.nextafter(previous, down))
                yield f"{qid} Q0 {doc_ids[row]} {rank} {float(written)!r} {tag}"
                previous = written


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"),
          (stat.S_ISSOCK, "a socket"))  # fmt: skip


def run_file_problem(path: Path) -> str | None:
    """Why a run file cannot be written at ``path`` (one phrase), or None when it can: a new
    name or an existing regular file, in a folder where a file can be created. Checked before
    the evaluation's work. Anything else is refused, never replaced: a device (``/dev/null``),
    a pipe, a folder, a symbolic link (replacing it would leave the file it points to as it
    was)."""
    path = Path(path)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        return f"cannot be examined ({exc.strerror})"
    if mode is not None and stat.S_ISLNK(mode):
        return f"is a symbolic link (to {os.readlink(path)}): give the file itself"
    if mode is not None and not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        return f"is {kind}, not a regular file: give the name of a file"
    if mode is not None and not os.access(path, os.W_OK):
        return "is read-only: make it writable, or give another name"
    folder = path.parent
    if not folder.is_dir():
        return f"the folder {folder} does not exist"
    try:  # the write's own first step: a temporary file beside the target
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.probe-", dir=folder)
    except OSError as exc:
        return f"the folder {folder} is not writable ({exc.strerror}): give a writable folder"
    os.close(fd)
    os.unlink(probe)
    return None


def write_trec_run(
    path: Path, result: EvalResult, doc_ids: Sequence[str], config: EvalConfig
) -> int:
    """Write :func:`trec_run_lines` to ``path`` atomically (a temporary file renamed onto it);
    an existing file keeps its mode (and owner, where this process may set it), a new one gets
    ``FILE_MODE``. Returns the number of lines. Call :func:`run_file_problem` first."""
    lines = list(trec_run_lines(result, doc_ids, config))
    path = Path(path)
    try:
        old: os.stat_result | None = path.stat()
    except FileNotFoundError:
        old = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    except OSError as exc:  # name the target, not the temporary file
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write("".join(f"{line}\n" for line in lines))
            os.fchmod(fh.fileno(), FILE_MODE if old is None else stat.S_IMODE(old.st_mode))
            if old is not None and (old.st_uid, old.st_gid) != (os.geteuid(), os.getegid()):
                with contextlib.suppress(PermissionError):  # only root may give a file away
                    os.fchown(fh.fileno(), old.st_uid, old.st_gid)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(lines)
