"""The cost file: what ``omniscale balance calibrate`` writes and what a run (``data.costs``)
or a plane (``plane serve --costs``) plans with. Pure data in and out (a parsed JSON document);
the trainer reads and writes the file (``tools.train.cost_model``).

The document holds every model in seconds: the LLM's ``alpha·ΣL + beta·ΣL² + gamma·n`` plus a
micro-batch's fixed cost (``llm.per_micro_batch``), each encoder kind's on its item size, and
optional per-token communication prices (``collectives``: the SP all-to-all and the reshard).
Whatever else it holds (scores, the measurements, provenance) is for people.
"""

from __future__ import annotations

from omniscale.balancer.cost import CostModel, Costs
from omniscale.media import MEDIA_KINDS

UNIT = "seconds"
COEFFICIENTS = ("alpha", "beta", "gamma")
COLLECTIVES = ("sp_comm_per_token", "reshard_per_token")  # seconds per token moved


def cost_document(llm: dict, encoders: dict, **facts) -> dict:
    """The file's document: ``llm`` (``alpha, beta, gamma, per_micro_batch`` and scores),
    ``encoders`` (kind -> ``alpha, beta, gamma`` and scores) and the facts of the measurement
    (device, model, ...), in the order a reader meets them."""
    for name, model in (("llm", llm), *encoders.items()):
        missing = [k for k in COEFFICIENTS if k not in model]
        if missing:
            raise ValueError(f"{name}: no {', '.join(missing)}")
    unknown = sorted(set(encoders) - set(MEDIA_KINDS))
    if unknown:
        raise ValueError(f"encoders: unknown kind {', '.join(unknown)}")
    return {"unit": UNIT, **facts, "llm": llm, "encoders": encoders}


def planner_costs(doc: dict) -> dict:
    """``PlaneConfig`` arguments from a cost document: ``cost_linear``, ``cost_quadratic`` and
    ``costs`` (every kind's ``[alpha, beta, gamma]``, a micro-batch's fixed cost, the
    collectives' per-token prices). Raises KeyError, ValueError or TypeError on a document
    that is not one."""
    llm = [float(doc["llm"][k]) for k in COEFFICIENTS]
    costs = {"llm": llm, "micro_batch": float(doc["llm"].get("per_micro_batch", 0.0)),
             **{k: float(v) for k, v in doc.get("collectives", {}).items() if k in COLLECTIVES}}
    for kind in MEDIA_KINDS:
        model = doc.get("encoders", {}).get(kind)
        costs[kind] = [float(model[k]) for k in COEFFICIENTS] if model else [0.0, 0.0, 0.0]
    return {"cost_linear": llm[0], "cost_quadratic": llm[1], "costs": costs}


# the calibrated costs that are one number each (Costs fields of the same name)
SCALARS = ("micro_batch", *COLLECTIVES)


def costs_of(costs: dict, linear: float | None = None, quadratic: float | None = None) -> Costs:
    """The planner's ``Costs`` of ``planner_costs(doc)["costs"]``: every kind's model, the
    micro-batch's fixed cost and the collectives' prices; ``linear`` and ``quadratic`` replace
    the LLM's alpha and beta (a plane's refit moves them during a run)."""
    alpha, beta, gamma = costs["llm"]
    return Costs(llm=CostModel(alpha if linear is None else linear,
                               beta if quadratic is None else quadratic, gamma),
                 encoders=tuple(CostModel(*costs[kind]) for kind in MEDIA_KINDS),
                 **{name: float(costs.get(name, 0.0)) for name in SCALARS})
