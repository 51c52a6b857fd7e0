"""Kafka source and transactional sink for PySpark's Python Data Source API."""
