"""Datasets, encoding cache, collation and DataModules."""
