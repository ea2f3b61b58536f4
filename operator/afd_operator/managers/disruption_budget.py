"""The PodDisruptionBudget over every pod of the deployment."""

from __future__ import annotations

from .. import naming
from ..observe import Observed
from ..writer import Writer
from . import Round, ensure_fetched


class DisruptionBudgetManager:
    def sync(self, r: Round) -> None:
        if not r.deleting:
            ensure_fetched(r.writer, r.shared["PodDisruptionBudget"])

    def remove_all(self, writer: Writer, namespace: str, name: str, observed: Observed) -> None:
        writer.delete("policy/v1", "PodDisruptionBudget", namespace, naming.pdb_name(name))
