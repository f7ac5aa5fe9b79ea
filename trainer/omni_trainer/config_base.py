"""The base of every manifest section: camelCase in YAML, snake_case in Python, no unknown fields.

Validation errors are reported with the YAML field path (see ``omni_trainer.config.format_errors``),
so every section of the manifest derives from :class:`Spec`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class Spec(BaseModel):
    """A section of the job manifest."""

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        validate_default=True,
    )
