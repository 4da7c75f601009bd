//! Errors the user must fix in the config, each naming where the bad value came from.

use std::fmt;

/// One problem in a config: where it came from, which key, what is wrong.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigIssue {
    /// The file, environment variable or `--set` argument that supplied the value.
    pub origin: String,
    /// Dotted key path (`stages.sampler.queue`), when the problem has one.
    pub key: Option<String>,
    /// What is wrong and, where possible, what would be right.
    pub message: String,
}

impl fmt::Display for ConfigIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.key {
            Some(k) => write!(f, "{}: `{}`: {}", self.origin, k, self.message),
            None => write!(f, "{}: {}", self.origin, self.message),
        }
    }
}

/// Every problem found in a config (validation keeps going after the first).
#[derive(Debug, Clone, Default)]
pub struct ConfigErrors(pub Vec<ConfigIssue>);

impl ConfigErrors {
    /// Adds one problem.
    pub fn push(&mut self, origin: impl Into<String>, key: Option<String>, message: impl Into<String>) {
        self.0.push(ConfigIssue { origin: origin.into(), key, message: message.into() });
    }

    /// True when nothing is wrong.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `Err(self)` when anything is wrong.
    pub fn into_result(self) -> Result<(), ConfigErrors> {
        if self.is_empty() { Ok(()) } else { Err(self) }
    }
}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0.len();
        if n > 1 {
            writeln!(f, "{n} problems in the config:")?;
        }
        for (i, issue) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            if n > 1 {
                write!(f, "  - ")?;
            }
            write!(f, "{issue}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}
