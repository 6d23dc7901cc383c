"""wasma inside Ray Serve LLM: `WorkflowRouter` and a `build_openai_app` that installs it."""

from wasma.ray_serve.app import build_openai_app, state_name
from wasma.ray_serve.router import WorkflowRouter
from wasma.ray_serve.scheduling import SchedulingState

__all__ = ["SchedulingState", "WorkflowRouter", "build_openai_app", "state_name"]
