"""The worker of an AFD Attention engine with micro-batch stages on vLLM's CPU platform.

Installed through vLLM's ``parallel_config.worker_cls`` (``compat.install_staged_worker``) only
when the afd block asks for more than one stage: ``CPUWorker`` as upstream, its model runner a
``CPUModelRunner`` with the plugin's micro-batch hooks (``stages.StagedRunnerMixin``).
"""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from .compat import afd_config_of
from .stages import StagedRunnerMixin


class AFDStagedCPUModelRunner(StagedRunnerMixin, CPUModelRunner):
    pass


class AFDCPUWorker(CPUWorker):
    def init_device(self):
        super().init_device()
        # The subclass adds hooks and no state of its own: swapping the class of the runner
        # upstream built keeps its construction exactly upstream's.
        self.model_runner.__class__ = AFDStagedCPUModelRunner
        cfg = afd_config_of(self.vllm_config)
        self.model_runner.afd_num_stages, self.model_runner.afd_min_split = cfg.num_stages, cfg.min_split_tokens
