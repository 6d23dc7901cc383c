"""wasma: workflow-aware scheduling for multi-agent LLM serving on vLLM engines.

The project's folders (``scheduler/``, ``engines/``, ``transfer/``, ``deploy/``,
``benchmarks/``) are the subpackages of this one import root; nothing else is installed.
"""
