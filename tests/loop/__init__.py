"""Tests of workers/loop/: the child loop, its policy gate and replay."""
