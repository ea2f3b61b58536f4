"""The plugin's vLLM 0.23.0 glue: everything that imports vLLM lives in this package.

``plugin`` (the entry point), ``compat`` (pinned version, the afd block of a VllmConfig, eager
mode for AFD engines off vLLM's CPU platform, the staged worker), ``experts`` (the remote-experts ``FusedMoE`` on Attention ranks),
``models`` (the model wrappers), ``loader`` (load format ``afd``), ``communicators`` (the direct
data plane's NCCL links on a GPU), ``ffn`` (the FFN server's
vLLM expert backend), ``stages`` and ``worker`` (micro-batch stages in the Attention forward and
the CPU worker that runs them) and ``cpu_patches`` (two CPU kernel fixes).
The core (``afd_shared_experts.*``) never imports this package at module level.
"""
