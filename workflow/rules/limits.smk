# The partition's time limit caps the time every job asks for (cluster.time_limit_min): the
# training jobs' requests come capped from the plan (collapse.segments); here every rule's
# runtime, its own or the profile's default-resources, is held to the limit too. Included
# last, after every rule exists.
from snakemake.resources import Resource

TIME_LIMIT_MIN = CFG.cluster.time_limit_min


def capped_runtime(runtime, limit):
    """A rule's runtime resource, never above ``limit`` minutes."""

    def cap(wildcards, input, attempt, threads, rulename, async_run):
        value = runtime.evaluate(
            wildcards,
            input=input,
            attempt=attempt,
            threads=threads,
            rulename=rulename,
            async_run=async_run,
        ).value
        return min(value, limit) if isinstance(value, int) else value

    return Resource("runtime", cap)


if TIME_LIMIT_MIN is not None:
    for _rule in workflow.rules:
        if "runtime" in _rule.resources:
            _rule.resources["runtime"] = capped_runtime(
                _rule.resources["runtime"], int(TIME_LIMIT_MIN)
            )
        else:
            _rule.resources["runtime"] = int(TIME_LIMIT_MIN)
