"""Builds the rules named in `compat.rules` and runs their hooks around a request.

Order: request hooks run in config order; response, stream and error hooks run in reverse config order,
so the rule listed first sees the request first and the response last (like nested middleware).
Rules whose `families` do not include the served model's family are dropped when the pipeline is built.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from deltafin.config import ConfigError
from deltafin.errors import DeltafinError
from deltafin.families import KNOWN_FAMILIES
from deltafin.rules.arguments import check_arguments
from deltafin.rules.base import Chunk, Request, Rule, RuleContext


@dataclass(frozen=True)
class NamedRule:
    name: str
    rule: Rule


@dataclass
class RulePipeline:
    rules: list[NamedRule] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rules]

    @property
    def preflight(self) -> list[str]:
        """Names of the rules that hold a stream's status until its first chunk."""
        return [r.name for r in self.rules if r.rule.preflight]

    def on_request(self, request: Request, ctx: RuleContext, changed: list[str]) -> Request:
        if not self.rules:
            return request
        request = copy.deepcopy(request)  # once: rules then never touch the client's own object
        return self._fold("request", self.rules, request, ctx, changed)

    def default_max_tokens(
        self, request: Request, ctx: RuleContext, changed: list[str], default: int | None = None
    ) -> int | None:
        """The max tokens of a request that names none, from the endpoint's `default`, in config order."""
        for named in self.rules:
            value = named.rule.default_max_tokens(default, request, ctx)
            if value != default:
                _mark(changed, named.name)
                default = value
        return default

    def on_response(self, body: dict, ctx: RuleContext, changed: list[str]) -> dict:
        return self._fold("response", reversed(self.rules), body, ctx, changed)

    def on_error(self, error: DeltafinError, ctx: RuleContext, changed: list[str]) -> DeltafinError:
        return self._fold("error", reversed(self.rules), error, ctx, changed)

    def on_stream(self, chunks: AsyncIterator[Chunk], ctx: RuleContext, changed: list[str]) -> AsyncIterator[Chunk]:
        for named in reversed(self.rules):
            wrapped = named.rule.stream(chunks, ctx)
            if wrapped is not None:
                _mark(changed, named.name)
                chunks = wrapped
        return chunks

    @staticmethod
    def _fold(hook: str, rules: Iterable[NamedRule], value: Any, ctx: RuleContext, changed: list[str]) -> Any:
        """Pass `value` through each rule's `hook`; a rule that returns a new object changed it."""
        for named in rules:
            result = getattr(named.rule, hook)(value, ctx)
            if result is not value:
                _mark(changed, named.name)
                value = result
        return value


def _mark(changed: list[str], name: str) -> None:
    if name not in changed:
        changed.append(name)


def build_pipeline(rules: Mapping[str, Any] | DictConfig, family: str) -> RulePipeline:
    """Instantiate `compat.rules` node by node; any problem is a ConfigError naming the rule."""
    nodes = cast(
        dict[str, Any], OmegaConf.to_container(rules, resolve=True) if isinstance(rules, DictConfig) else dict(rules)
    )
    built: list[NamedRule] = []
    for name, node in nodes.items():
        where = f"compat.rules.{name}"
        if not isinstance(node, dict) or "_target_" not in node:
            raise ConfigError(f"{where}: a rule needs `_target_` (the rule's class) and its arguments")
        node = dict(node)
        families = node.pop("families", None)
        if families is not None:
            if isinstance(families, str) or not all(isinstance(f, str) for f in families):
                raise ConfigError(f"{where}.families: a list of family names, e.g. [glm]")
            unknown = sorted(set(families) - KNOWN_FAMILIES)
            if unknown:
                raise ConfigError(
                    f"{where}.families: unknown family {unknown[0]!r} (known: {', '.join(sorted(KNOWN_FAMILIES))})"
                )
        # Every rule's values are checked, whichever family it serves: they are keys of this config.
        target = _rule_class(node["_target_"])
        if target is not None:
            check_arguments(target, {k: v for k, v in node.items() if not _hydra_key(k)}, where)
        if families is not None and family not in families:
            continue
        try:
            rule = instantiate(node, _convert_="all")
        except InstantiationException as exc:
            cause = exc.__cause__
            reason = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
            reason = " ".join(reason.split(", set env var HYDRA_FULL_ERROR")[0].split())
            raise ConfigError(f"{where}: {reason}") from None
        except Exception as exc:  # a rule's constructor validating its own arguments
            raise ConfigError(f"{where}: {exc}") from None
        if not isinstance(rule, Rule):
            raise ConfigError(f"{where}: {node['_target_']} is not a deltafin Rule")
        built.append(NamedRule(name, rule))
    return RulePipeline(built)


def _hydra_key(key: str) -> bool:
    """`_target_`, `_convert_`, ...: Hydra's own keys, not the rule's arguments."""
    return key.startswith("_") and key.endswith("_")


def _rule_class(target: Any) -> type | None:
    """The class `_target_` names, when it is a Rule (anything else is reported by instantiate, below)."""
    try:
        found = get_class(str(target))
    except Exception:
        return None
    return found if isinstance(found, type) and issubclass(found, Rule) else None
