"""End-of-run deployables: which submodel each board deploys, the orders that send it, and the summary rows.

A board builds its own bundle (TensorRT engines are tied to the GPU that built them), so after the
last round the server sends every board that asked an export order holding the final weights of its
submodel, exactly as the server evaluates it (its EvalTarget: NeFL's own BN and steps, FjORD's width
statistics, DepthFL's ensemble). The board's export report comes back through the transport, which
admits it with `ExportLedger.admit`; summary.json's "deployables" lists one row per registered device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nestling.server.registry import DeviceRecord
from nestling.server.strategies.base import DeviceInfo, EvalTarget, Strategy
from nestling.slicing import extract
from nestling.wire.export_messages import ExportOrder, ExportReport

NO_REPORT, NOT_REQUESTED, OFFLINE = "no report", "not requested", "offline"


def wants_export(profile: dict[str, Any] | None) -> bool:
    """True when a board's hello asks for its final model ({"export": {"on_finish": true, ...}})."""
    export = (profile or {}).get("export")
    return isinstance(export, dict) and export.get("on_finish") is True


def deployable_target(
    strategy: Strategy, device: DeviceInfo, last_round: int, targets: list[EvalTarget]
) -> EvalTarget:
    """The submodel `device` deploys, with the weights the server evaluates it with.

    The strategy names the spec (Strategy.deploy_spec); its evaluated target carries the right
    per-submodel state. A spec the method does not evaluate (FeDepth's auxiliary exits only train)
    deploys the method's only evaluated model, else a slice of the deployable full model."""
    spec = strategy.deploy_spec(device, last_round)
    for target in targets:
        if target.spec.id == spec.id:
            return target
    if len(targets) == 1:
        return targets[0]
    per_width = spec.width if spec.model.norm_stats == "per_width" else None
    return EvalTarget(
        f"spec-{spec.id}", spec, extract(strategy.global_export_state(), spec), active_width=per_width
    )


def export_orders(
    strategy: Strategy, devices: list[DeviceInfo], last_round: int, mode: str
) -> list[ExportOrder]:
    """One order per device that should export: all of them (mode "all") or those that asked ("requested")."""
    chosen = [d for d in devices if mode == "all" or (mode == "requested" and wants_export(d.profile))]
    if not chosen:
        return []
    targets = strategy.eval_targets()
    orders = []
    for device in chosen:
        target = deployable_target(strategy, device, last_round, targets)
        orders.append(
            ExportOrder(
                device_id=device.device_id,
                round=last_round,
                order_id=f"export-r{last_round}-{device.device_id}",
                name=target.name,
                spec=target.spec.to_dict(),
                weights=target.state,
                ensemble=target.ensemble,
                static_bn=target.static_bn,
                active_width=target.active_width,
                method=strategy.name,
            )
        )
    return orders


@dataclass(frozen=True)
class SentOrder:
    """What the server remembers of an order (not its weights): enough to check the report that answers it."""

    order_id: str
    spec_id: str
    name: str


@dataclass
class ExportLedger:
    """Export orders sent at the end of a run and the reports admitted for them (one per device)."""

    orders: dict[str, SentOrder] = field(default_factory=dict)  # device id → its order
    transfers: set[str] = field(default_factory=set)  # chunked orders: their re-requests are answered on ctrl
    reports: dict[str, ExportReport] = field(default_factory=dict)

    def sent(self, order: ExportOrder, transfer_id: str | None) -> None:
        self.orders[order.device_id] = SentOrder(order.order_id, order.spec_id, order.name)
        if transfer_id is not None:
            self.transfers.add(transfer_id)

    def pending(self) -> list[str]:
        return sorted(set(self.orders) - set(self.reports))

    def admit(self, device_id: str, report: ExportReport, session: str, my_session: str) -> str | None:
        """Store `report` when it answers this server's order to `device_id`; else the rejection reason."""
        order = self.orders.get(device_id)
        if report.device_id != device_id:
            return "wrong_device"
        if session != my_session:
            return "stale_session"
        if order is None or report.order_id != order.order_id:
            return "unknown_export"
        if device_id in self.reports:
            return "duplicate"
        if report.spec_id != order.spec_id and report.status == "ok":
            return "wrong_spec"
        self.reports[device_id] = report
        return None


def deployable_rows(records: dict[str, DeviceRecord], ledger: ExportLedger) -> list[dict[str, Any]]:
    """summary.json's "deployables": one row per registered device, reported or not."""
    rows = []
    for device_id in sorted(records):
        order, report = ledger.orders.get(device_id), ledger.reports.get(device_id)
        if report is not None:
            rows.append(report.to_dict())
        elif order is not None:
            rows.append(
                {
                    "device_id": device_id,
                    "status": NO_REPORT,
                    "submodel": order.name,
                    "spec_id": order.spec_id,
                    "order_id": order.order_id,
                }
            )
        else:
            asked = wants_export(records[device_id].info.profile)
            status = OFFLINE if asked and not records[device_id].online else NOT_REQUESTED
            rows.append({"device_id": device_id, "status": status})
    return rows


def _p50(row: dict[str, Any]) -> str:
    batch = (row.get("latency_ms") or {}).get("batch_1") or {}
    for runtime in ("tensorrt", "onnxruntime_int8", "onnxruntime"):
        if isinstance(batch.get(runtime), dict):
            return f"{batch[runtime]['p50_ms']:.3f} {runtime}"
    return "-"


def _parity(row: dict[str, Any]) -> str:
    reported = [v.get("max_rel") for v in (row.get("parity") or {}).values() if isinstance(v, dict)]
    worst: list[float] = [float(w) for w in reported if isinstance(w, (int, float))]
    return f"{max(worst):.1e}" if worst else "-"


def deployables_table(rows: list[dict[str, Any]]) -> str:
    """A small per-device table for the operator at the end of `nestling server`."""
    header = ("device", "status", "submodel", "models", "max rel err", "p50 ms (batch 1)", "bundle / note")
    lines = [header]
    for row in rows:
        note = row.get("error") or row.get("bundle") or ""
        reason = (row.get("tensorrt") or {}).get("reason")
        if reason and row.get("status") == "ok":
            note = f"{note}  ({reason})"
        lines.append(
            (
                row["device_id"],
                row["status"],
                row.get("submodel") or "-",
                "+".join(row.get("models") or []) or "-",
                _parity(row),
                _p50(row),
                note,
            )
        )
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(str(v).ljust(w) for v, w in zip(line, widths)) + "  " + str(line[-1]) for line in lines
    ).rstrip()
