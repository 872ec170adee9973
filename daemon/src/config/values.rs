//! What a key's value is: a number within a range ([`Bounded`]), or a text, path or switch
//! ([`Plain`]); each knows its default, what it allows, and how the example file and the
//! guide show them ([`Shown`]).

/// A number a bounded key may hold.
pub trait Num: Copy + PartialOrd + std::fmt::Display + std::fmt::Debug + Send + Sync + 'static {
    /// Its type in the guide's key table.
    const KIND: &'static str;
    /// How the value of a key of this type is written: a whole number, or a number with a
    /// decimal point (TOML's float, `30.0`).
    fn written(self) -> String;
    fn is_finite(self) -> bool {
        true
    }
    /// A value just past this one, down and up (for the tests of the ranges).
    fn nearby(self) -> (Option<Self>, Option<Self>);
}

macro_rules! whole {
    ($($t:ty),*) => {$(
        impl Num for $t {
            const KIND: &'static str = "integer";
            fn written(self) -> String {
                self.to_string()
            }
            fn nearby(self) -> (Option<Self>, Option<Self>) {
                (self.checked_sub(1), self.checked_add(1))
            }
        }
    )*};
}
whole!(u32, u64, usize);

impl Num for f64 {
    const KIND: &'static str = "number";
    fn written(self) -> String {
        format!("{self:?}")
    }
    fn is_finite(self) -> bool {
        f64::is_finite(self)
    }
    fn nearby(self) -> (Option<Self>, Option<Self>) {
        (Some(self - 0.5), Some(self + 0.5))
    }
}

/// A numeric key: its name, default and the values it allows. The parser's default and range
/// error ([`Bounded::read`]), the example file's default and the admin guide's default and
/// range all come from here.
#[derive(Debug, Clone, Copy)]
pub struct Bounded<T: Num> {
    pub name: &'static str,
    pub default: T,
    pub min: T,
    /// `min` itself is refused ("above 0").
    pub above_min: bool,
    /// `None`: no upper bound.
    pub max: Option<T>,
    /// `max` itself is refused ("below 1").
    pub below_max: bool,
    /// What `min` means where it is special ("never").
    pub at_min: Option<&'static str>,
}

impl<T: Num> Bounded<T> {
    pub(super) const fn new(name: &'static str, default: T, min: T, max: Option<T>) -> Self {
        Bounded {
            name,
            default,
            min,
            above_min: false,
            max,
            below_max: false,
            at_min: None,
        }
    }
    pub(super) const fn meaning_at_min(self, what: &'static str) -> Self {
        Bounded {
            at_min: Some(what),
            ..self
        }
    }
    pub(super) const fn above_min(self) -> Self {
        Bounded {
            above_min: true,
            ..self
        }
    }
    pub(super) const fn below_max(self) -> Self {
        Bounded {
            below_max: true,
            ..self
        }
    }

    /// Whether the key may hold `v`.
    pub fn allows(&self, v: T) -> bool {
        let low = if self.above_min { v > self.min } else { v >= self.min };
        let high = match self.max {
            None => true,
            Some(m) if self.below_max => v < m,
            Some(m) => v <= m,
        };
        v.is_finite() && low && high
    }

    /// The configured value, or the default; one out of range is an error naming the key and
    /// its range.
    pub fn read(&self, v: Option<T>) -> Result<T, String> {
        match v {
            None => Ok(self.default),
            Some(v) if self.allows(v) => Ok(v),
            Some(v) => Err(format!("{} = {v}: must be {}", self.name, self.range())),
        }
    }
}

/// What the guide and the example show of a bounded key, whatever its type.
pub trait Shown: Sync + std::fmt::Debug {
    fn default_text(&self) -> String;
    fn range(&self) -> String;
    /// Values at and just past the range's ends, as a file writes them, and whether each is
    /// allowed.
    fn edges(&self) -> Vec<(String, bool)>;
}

impl<T: Num> Shown for Bounded<T> {
    fn default_text(&self) -> String {
        self.default.written()
    }
    fn range(&self) -> String {
        let low = match (self.above_min, self.at_min) {
            (true, _) => format!("above {}", self.min),
            (false, Some(what)) => format!("{} ({what})", self.min),
            (false, None) => self.min.to_string(),
        };
        match self.max {
            None => format!("{low} or more"),
            Some(m) if self.above_min => format!("{low}, at most {m}"),
            Some(m) if self.below_max => format!("{low} to below {m}"),
            Some(m) => format!("{low} to {m}"),
        }
    }
    fn edges(&self) -> Vec<(String, bool)> {
        let (below, _) = self.min.nearby();
        let mut values = vec![Some(self.min), below];
        if let Some(m) = self.max {
            values.extend([Some(m), m.nearby().1]);
        }
        values
            .into_iter()
            .flatten()
            .map(|v| (v.written(), self.allows(v)))
            .collect()
    }
}

/// A key whose value is a text, a path or a switch, with a default that is a value: the
/// parser's default ([`Plain::text`], [`Plain::path`], [`Plain::read`]) and what the example
/// file and the guide show come from here.
#[derive(Debug, Clone, Copy)]
pub struct Plain<T: 'static> {
    pub name: &'static str,
    pub default: T,
    /// The values it allows, in words.
    pub range: &'static str,
}

impl Plain<&'static str> {
    /// The configured text, or the default.
    pub fn text(&self, v: Option<String>) -> String {
        v.unwrap_or_else(|| self.default.to_string())
    }
    /// The configured path, or the default.
    pub fn path(&self, v: Option<std::path::PathBuf>) -> std::path::PathBuf {
        v.unwrap_or_else(|| self.default.into())
    }
}

impl Plain<bool> {
    /// The configured switch, or the default.
    pub fn read(&self, v: Option<bool>) -> bool {
        v.unwrap_or(self.default)
    }
}

impl Shown for Plain<&'static str> {
    fn default_text(&self) -> String {
        toml::Value::String(self.default.to_string()).to_string()
    }
    fn range(&self) -> String {
        self.range.to_string()
    }
    fn edges(&self) -> Vec<(String, bool)> {
        Vec::new()
    }
}

impl Shown for Plain<bool> {
    fn default_text(&self) -> String {
        self.default.to_string()
    }
    fn range(&self) -> String {
        self.range.to_string()
    }
    fn edges(&self) -> Vec<(String, bool)> {
        vec![("true".into(), true), ("false".into(), true)]
    }
}
