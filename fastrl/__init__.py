"""The plumbing behind the four method scripts, apart from the methods (as CleanRL keeps
cleanrl_utils/ apart): the vLLM sampler process and its weight sync, the learner under torchrun,
the built-in tiny model, the GPU memory plan, flags and checks (checks), run logging and checkpoints
(runlog), the sampler's start (launch). Its modules never import common.py, tasks.py or a script:
imports run scripts -> common, tasks -> fastrl. Each module's contract opens it."""
