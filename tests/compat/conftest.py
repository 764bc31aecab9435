"""tests/compat: vLLM-style code on pinstage. The vendored vLLM tree under vllm/ is run by its
own runner (vllm/run.py, driven by test_vllm_harness.py), never collected here."""

collect_ignore = ["vllm"]
