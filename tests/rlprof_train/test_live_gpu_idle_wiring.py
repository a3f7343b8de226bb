"""The trainer's live gauge of the GPU's idle share (rlprof.live_gpu_idle), wired in PPOTrainer.fit: in this process
on the host, in a world of one made for the test and gone after it (conftest.world_of_one)."""

from __future__ import annotations

import rlprof
from rlprof.live_gpu_idle import WindowGpuIdle
from tests.rlprof.test_prometheus import free_ports
from tests.rlprof.test_session import torch_config

from conftest import world_of_one


def test_the_trainer_hands_each_torch_trace_to_its_gauge_read_by_its_live_backend_and_closes_it(tmp_path, monkeypatch):
    """The trainer's wiring, in this process on the host: the gauge follows the session (every trace of the torch
    window reaches it), its samples are a live source of the run's prometheus backend, and it is closed with the run
    (on a CPU the trace measures no GPU: the samples stay empty)."""
    from rlprof_train import trainer as trainer_module
    from rlprof_train.config.load import load_trainer_config
    from tests.rlprof_train.test_device_placement import SMALL

    made: list[tuple[WindowGpuIdle, list]] = []
    heard: list[tuple[str, str | None]] = []

    class Followed(WindowGpuIdle):
        @classmethod
        def follow(cls, session, tracker):
            gauge = super().follow(session, tracker)
            made.append((gauge, list(tracker.backends)))  # the tracker lets go of them when it closes
            return gauge

        def output_written(self, path, format, window, role):
            heard.append((path.name, format))
            super().output_written(path, format, window, role)

    monkeypatch.setattr(trainer_module, "WindowGpuIdle", Followed)
    cfg = load_trainer_config(
        [
            "--config-name=demo",
            *SMALL,
            f"trainer.log_dir={tmp_path / 'logs'}",
            f"trainer.default_local_dir={tmp_path / 'ckpt'}",
            'trainer.logger=["file","prometheus"]',
            f"trainer.prometheus.port={free_ports(1)}",
            "trainer.save_freq=-1",
        ]
    )
    session = rlprof.init(torch_config(tmp_path / "profile", steps=[2]))
    try:
        with world_of_one("cpu") as env:
            trainer_module.PPOTrainer(cfg, env, "gauge", lambda line: None).fit()
    finally:
        rlprof.shutdown()
    ((gauge, backends),) = made
    assert heard == [("rank0.pt.trace.json.gz", "chrome_trace")]
    (prometheus,) = [b for b in backends if b.name == "prometheus"]
    assert gauge.live_samples in prometheus.live
    assert gauge not in session.listeners and gauge.wait(1) and gauge.live_samples() == []
