"""What an experiment records about the machine that ran it.

Float32 results differ in their last bits between CPUs and, on one CPU, between kernel settings
(MKL's code path, ATen's ISA, a library preloaded in front of them): ``machine_info`` records
the CPU, torch's dispatch and the kernel-steering environment variables that were set, and the
experiment's table names them."""

from __future__ import annotations

from app.training.evaluate import KERNEL_ENV, machine_info
from app.training.experiment_plan import Plan
from app.training.experiment_tables import _environment_line
from policy.train_config import TrainConfig


def test_machine_info_records_the_kernel_steering_environment(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    for key in KERNEL_ENV:
        monkeypatch.delenv(key, raising=False)
    plain = machine_info.__wrapped__()
    assert plain["kernel_env"] == {}
    assert plain["cpu_model"] and plain["torch_cpu_capability"] and plain["cpu_count"] >= 1
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "")  # set but empty: torch ignores it, so do we
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # threads are recorded elsewhere, not here
    steered = machine_info.__wrapped__()
    assert steered["kernel_env"] == {"MKL_CBWR": "COMPATIBLE"}
    assert {k: v for k, v in steered.items() if k != "kernel_env"} == {
        k: v for k, v in plain.items() if k != "kernel_env"
    }


def test_the_experiment_table_names_the_kernel_environment() -> None:
    cfg = TrainConfig.from_preset("casi", steps=2, n_actions=2).to_dict()
    machine = {"cpu_model": "Xeon", "isa_flags": ["avx2"], "torch_cpu_capability": "AVX2",
               "cpu_count": 2, "gpu": None}  # fmt: skip
    line = _environment_line(Plan("x", ["shapley"], [0], cfg, {"machines": [machine]}))
    assert line.endswith("torch AVX2), 2 cores.")
    machine["kernel_env"] = {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "LD_PRELOAD": "/opt/x.so"}
    line = _environment_line(Plan("x", ["shapley"], [0], cfg, {"machines": [machine]}))
    assert line.endswith("2 cores, LD_PRELOAD=/opt/x.so, MKL_ENABLE_INSTRUCTIONS=AVX2.")
