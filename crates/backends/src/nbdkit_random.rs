//! nbdkit's pseudo-random numbers (its `common/include/random.h`):
//! xoshiro256** 1.0 seeded by splitmix64. The random, sparse-random and
//! partitioning devices draw from it as nbdkit's plugins do, so that the
//! same seed gives the same bytes under both servers.

/// The generator's state.
#[derive(Debug, Clone)]
pub struct Xoshiro256 {
    s: [u64; 4],
}

impl Xoshiro256 {
    /// The state nbdkit's `xsrandom(seed)` makes: four splitmix64 draws.
    pub fn seeded(mut seed: u64) -> Xoshiro256 {
        let mut next = || {
            seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = seed;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Xoshiro256 {
            s: [next(), next(), next(), next()],
        }
    }

    /// The next 64 random bits (nbdkit's `xrandom`).
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_seeding_matches_the_reference() {
        // splitmix64 from seed 0: its published first output.
        let x = Xoshiro256::seeded(0);
        assert_eq!(x.s[0], 0xe220_a839_7b1d_cdaf);
        // The generator moves and does not repeat at once.
        let mut x = Xoshiro256::seeded(1);
        let a = x.next_u64();
        assert_ne!(a, x.next_u64());
    }
}
