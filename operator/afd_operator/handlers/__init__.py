"""Thin kopf handlers: they gather kopf's inputs and call plain modules."""
