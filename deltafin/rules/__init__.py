"""Request/response rewrite rules (one per module) and the pipeline that runs them from `compat.rules`."""

from deltafin.rules.base import Rule, RuleContext
from deltafin.rules.pipeline import RulePipeline, build_pipeline

__all__ = ["Rule", "RuleContext", "RulePipeline", "build_pipeline"]
