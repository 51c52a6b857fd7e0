"""Kafka source and transactional sink for PySpark's Python Data Source API."""

import os as _os

# Every Python process that Spark starts for the source or the sink (planners, the tasks'
# workers, the sink's commit runner) imports this package first. Started for the onceflow
# service, it logs as the service does (onceflow.logs); in a user's own application, the
# variable is not set and logging is left alone.
if "_ONCEFLOW_SPARK_PROCESS_LOG_LEVEL" in _os.environ:
    from onceflow import logs as _logs

    _logs.configure_spark_process()
