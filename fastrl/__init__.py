"""The plumbing behind the four method scripts, apart from the methods (as CleanRL keeps
cleanrl_utils/ apart): the vLLM sampler process and its weight sync, the learner under torchrun,
the built-in tiny model, the GPU memory plan. Its modules never import common.py, tasks.py or a
script: imports run scripts -> common -> fastrl. Each module's contract opens it."""
