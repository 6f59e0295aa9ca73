"""Whole-system tests: live workers, fake model servers, revival, the deploy topology and the TypeScript client."""
