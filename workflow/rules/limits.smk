# The partition's time limit caps the time every job asks for (cluster.time_limit_min): the
# training jobs' requests come capped from the plan (collapse.segments); here every rule's
# runtime, its own or the profile's default-resources, is held to the limit too. Included
# last, after every rule exists.
from collapse.segments import cap_runtimes

if CFG.cluster.time_limit_min is not None:
    cap_runtimes(workflow.rules, CFG.cluster.time_limit_min)
