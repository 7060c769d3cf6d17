//! Seeded randomness: a randomized test takes its seed from an environment
//! variable (decimal, `0x` hex, or `random` for one drawn from the clock),
//! else a fixed default (so CI's runs are reproducible), and prints it so
//! that a failing run can be repeated.

use rand::rngs::StdRng;
use rand::SeedableRng;

/// A seed drawn from the clock.
pub fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos() as u64
}

/// Parses a seed: decimal or `0x` hex.
pub fn parse_seed(s: &str) -> Result<u64, std::num::ParseIntError> {
    let s = s.trim();
    match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    }
}

/// The seed of environment variable `var`: its value (decimal or `0x`
/// hex; `random`: drawn from the clock), else `default` (`None`: drawn
/// from the clock). Panics on a value that is not a number. Prints
/// `var=seed` on stderr (shown with a failing test's output).
pub fn seed(var: &str, default: Option<u64>) -> u64 {
    let seed = match std::env::var(var).ok().filter(|s| !s.trim().is_empty()) {
        Some(s) if s.trim() == "random" => clock_seed(),
        Some(s) => parse_seed(&s).unwrap_or_else(|e| panic!("{var}={s:?}: {e}")),
        None => default.unwrap_or_else(clock_seed),
    };
    eprintln!("{var}={seed:#x}");
    seed
}

/// A generator seeded with `seed`: the same seed, the same sequence.
pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// A xorshift64 generator (shifts 13, 7, 17) started at its seed (not
/// 0): a fixed, dependency-free sequence for table tests that need no
/// particular distribution.
#[derive(Clone, Debug)]
pub struct Xorshift(pub u64);

impl Xorshift {
    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A value below `n` (not 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// [`Xorshift`] from `seed` as a closure.
pub fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut x = Xorshift(seed);
    move || x.next_u64()
}

#[cfg(test)]
mod tests {
    use rand::Rng;

    use super::*;

    #[test]
    fn seeds_parse_in_decimal_and_hex_and_reproduce_the_sequence() {
        assert_eq!(parse_seed("0x5eed"), Ok(0x5eed));
        assert_eq!(parse_seed(" 42 "), Ok(42));
        assert!(parse_seed("five").is_err());
        let (mut a, mut b) = (rng(7), rng(7));
        for _ in 0..4 {
            assert_eq!(a.random::<u64>(), b.random::<u64>());
        }
        assert_eq!(seed("NPM_TESTKIT_UNSET_SEED", Some(9)), 9);
    }
}
