"""`spec.autoscaling.ratio`: the declared prefill:decode bounds (kept apart from models.py, which holds the
rest of the spec; `autoscaler_ratio.py` enforces them)."""

from __future__ import annotations

from pydantic import ConfigDict, Field, model_validator

from pdcluster.operator.pod_spec import SpecModel, cel


class Ratio(SpecModel):
    """Declared bounds of the prefill:decode ratio (prefill instances per decode instance)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("!has(self.min) || !has(self.max) || self.min <= self.max",
                    "autoscaling.ratio.min must be <= autoscaling.ratio.max"),
            ]
        }
    )
    min: float | None = Field(default=None, gt=0, le=1000,
                              description="Fewest prefill instances per decode instance (P/D at least this).")
    max: float | None = Field(default=None, gt=0, le=1000,
                              description="Most prefill instances per decode instance (P/D at most this).")

    @model_validator(mode="after")
    def _ordered(self) -> Ratio:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError("autoscaling.ratio.min must be <= autoscaling.ratio.max")
        return self
