"""Tests of workers/records/: fork records, the journal, allocation, seeds, notifications and stored formats."""
