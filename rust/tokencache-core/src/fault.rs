//! Deliberate bugs, planted only by the model test's self-test to prove it catches them. Built
//! only with the `fault-injection` feature, so production trees carry no fault checks.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forget to tell the parent when a node stops being protected.
    SkipParentOnUnprotect,
    /// Report one token too few from every match.
    ShortMatch,
}
