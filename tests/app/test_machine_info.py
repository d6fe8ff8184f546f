"""What an experiment records about the machine that ran it.

Float32 results differ in their last bits between CPUs and, on one CPU, between kernel settings
(MKL's code path, ATen's ISA, a library preloaded in front of them): ``machine_info`` records
the CPU, torch's dispatch and the kernel-steering environment variables that were set (every
cell file of a protocol records it under ``compute.machines``)."""

from __future__ import annotations

from app.training.evaluate import KERNEL_ENV, machine_info


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
