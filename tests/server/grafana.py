"""The Grafana dashboard deploy/ ships, and the metrics its PromQL queries select (shared by
the deploy checks and the replicas test, which scrapes what the servers export)."""
from __future__ import annotations

import json

import promql_parser

from eagle_serve import paths


def dashboard() -> dict:
    return json.loads((paths.REPO_ROOT / "deploy" / "grafana" / "eagle-serve.json").read_text())


def dashboard_queries() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """The metrics a PromQL expression selects (raises on a syntax error)."""
    names, todo = set(), [promql_parser.parse(expr)]
    while todo:
        node = todo.pop()
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)
        elif isinstance(node, promql_parser.MatrixSelector):
            todo.append(node.vector_selector)
        elif isinstance(node, promql_parser.BinaryExpr):
            todo += [node.lhs, node.rhs]
        elif isinstance(node, promql_parser.Call):
            todo += list(node.args)
        elif isinstance(node, (promql_parser.AggregateExpr, promql_parser.ParenExpr,
                               promql_parser.UnaryExpr, promql_parser.SubqueryExpr)):
            todo.append(node.expr)
    return names
