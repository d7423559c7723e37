"""Workflow DAGs: node spec, function registry, validation and the planner."""

from distflow_jax.dag.planner import Plan, Topology, make_plan
from distflow_jax.dag.render import render
from distflow_jax.dag.registry import FUNCTIONS, FunctionSpec, Placement, Registry
from distflow_jax.dag.spec import DagError, Node, NodeType, Role
from distflow_jax.dag.validate import Dag, build_dag

__all__ = ["FUNCTIONS", "Dag", "DagError", "FunctionSpec", "Node", "NodeType", "Placement",
           "Plan", "Registry", "Role", "Topology", "build_dag", "make_plan", "render"]
