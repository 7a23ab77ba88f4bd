"""Builds `services/bench/overlap-64x128.json`, the overlap workload for speculative decoding.

Sixteen passages (prose, a letter, minutes, instructions, Python, JavaScript, C and SQL), each
asked for in four ways (repeat, quote, correct, copy): 64 chat-templated prompts for the embedded
SmolLM2-135M-Instruct, greedy, exactly 128 output tokens each with EOS ignored, plus one
single-request latency case. Every passage is longer than 128 tokens, so that a faithful answer
is still inside the passage when the 128th token is produced: an answer that ran out of passage
would fill the rest of its fixed length with whatever the model makes up after its EOS, which
measures nothing about text that repeats its prompt.

    .venv/bin/python -m benchmarks.build_overlap_workload
"""

from __future__ import annotations

import json
from pathlib import Path

from vmesh.services.common.model_loading import resolve_model_dir
from vmesh.services.common.tokenizer import load_chat_tokenizer

OUT = Path(__file__).resolve().parents[1] / "services" / "bench" / "overlap-64x128.json"
MAX_NEW_TOKENS = 128
INSTRUCTIONS = (
    "Repeat the following text exactly, word for word:",
    "Quote the following text in full, then stop:",
    "Fix any spelling mistakes in the following text and return the whole text:",
    "Copy the following text, keeping its lines as they are:",
)


def prose(text: str) -> str:
    """A paragraph written over several source lines, as one line."""
    return " ".join(text.split())


PASSAGES = (
    prose("""The lighthouse stood at the end of a narrow spit of rock, and every evening the keeper climbed its
          one hundred and twelve steps to light the lamp. He counted them out loud, partly from habit and
          partly because the sound of his own voice kept the loneliness away. Ships passed far out at sea,
          their lights small as stars, and none of them knew his name. In winter the storms came in from the
          west and shook the glass of the lantern room until he thought it would break. He wrote down the
          wind, the waves and the ships he saw in a thick logbook, one line for every hour, and on the last
          page of each book he drew the view from his window as it looked that night. Nobody ever asked to see
          the drawings, but he kept every book on a shelf above his bed."""),
    prose("""To make a simple loaf of bread, mix five hundred grams of flour with ten grams of salt, seven grams
          of dried yeast and three hundred and fifty millilitres of warm water. Knead the dough for ten
          minutes until it is smooth and elastic, then leave it to rise in a warm place for an hour. Shape it,
          let it rise again, and bake it at two hundred and twenty degrees for thirty minutes. The loaf is
          ready when it is golden brown and sounds hollow when you tap the bottom. Let it cool on a wire rack
          for at least half an hour before you cut it, or the inside will be sticky. Wrapped in a clean cloth,
          it keeps for two or three days. Any bread that is left after that makes very good toast or
          breadcrumbs."""),
    """def merge_sorted(left, right):
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result


def merge_sort(items):
    if len(items) <= 1:
        return list(items)
    middle = len(items) // 2
    left = merge_sort(items[:middle])
    right = merge_sort(items[middle:])
    return merge_sorted(left, right)


if __name__ == "__main__":
    print(merge_sort([5, 3, 9, 1, 7, 2, 8]))""",
    prose("""Dear Ms. Patel, thank you for your letter of the fourth of March. I am pleased to confirm that your
          order of forty copies of the handbook has been dispatched and should arrive within five working
          days. If any of the copies are damaged in transit, please let us know and we will replace them at no
          cost. The invoice is enclosed with the parcel, and payment is due within thirty days of delivery.
          You can pay by bank transfer to the account shown on the invoice, quoting the order number so that
          we can match your payment quickly. We hope the handbooks are useful for your new staff. If you would
          like further copies for your other offices, we can offer a discount on any order of twenty copies or
          more. With kind regards, the customer service team."""),
    prose("""The committee met on Tuesday to discuss the new library opening hours. After a long debate, it
          agreed that the library will open at nine in the morning and close at eight in the evening on
          weekdays, and open from ten until four on Saturdays. The changes will take effect from the first of
          next month, and notices will be posted at the entrance. The committee also discussed the reading
          room on the second floor, which is often too cold in winter. It was agreed to ask the council for
          money to repair the heating before November. Several members asked for more computers in the
          children's section, and the librarian will report on the cost at the next meeting, which will be
          held on the third Tuesday of the month at half past six."""),
    """class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, item):
        self.counts[item] = self.counts.get(item, 0) + 1

    def most_common(self, n):
        ranked = sorted(self.counts.items(), key=lambda pair: pair[1], reverse=True)
        return ranked[:n]

    def total(self):
        return sum(self.counts.values())

    def remove(self, item):
        if item in self.counts:
            self.counts[item] -= 1
            if self.counts[item] == 0:
                del self.counts[item]


counter = Counter()
for word in "the cat sat on the mat with the hat".split():
    counter.add(word)
print(counter.most_common(2), counter.total())""",
    prose("""Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide
          into sugar and oxygen. It takes place mainly in the leaves, inside small structures called
          chloroplasts, which contain the green pigment chlorophyll. The sugar feeds the plant and the oxygen
          is released into the air, which is why forests are sometimes called the lungs of the planet. Water
          is taken up by the roots and carried to the leaves through thin tubes, while carbon dioxide enters
          through tiny openings on the underside of each leaf. When the light is weak or the weather is very
          dry, these openings close and the process slows down. Without this slow and quiet work in billions
          of leaves, there would be almost no food and very little oxygen for the animals and people of the
          world."""),
    prose("""Our hiking group will meet at the car park at seven o'clock on Saturday morning. Please bring sturdy
          boots, a waterproof jacket, at least two litres of water and a packed lunch. The route is about
          fourteen kilometres long with a steep climb in the middle, so expect to be back by four in the
          afternoon. If the weather turns bad, we will take the shorter path along the river. We will stop for
          lunch at the old stone hut near the top, where there is a good view of the lake on a clear day.
          Anyone who wants to share a car should reply to this message by Thursday evening, and please tell us
          if you cannot come after all. The walk is suitable for beginners who are reasonably fit."""),
    """SELECT customers.name, COUNT(orders.id) AS order_count, SUM(orders.total) AS revenue
FROM customers
JOIN orders ON orders.customer_id = customers.id
WHERE orders.created_at >= '2024-01-01'
GROUP BY customers.name
HAVING COUNT(orders.id) > 3
ORDER BY revenue DESC
LIMIT 20;

SELECT products.category, AVG(order_items.price) AS average_price, SUM(order_items.quantity) AS units
FROM order_items
JOIN products ON products.id = order_items.product_id
JOIN orders ON orders.id = order_items.order_id
WHERE orders.status = 'shipped'
GROUP BY products.category
ORDER BY units DESC;""",
    prose("""The old clock in the town square had stopped at a quarter past three many years ago, and nobody
          could remember when. Children grew up believing it was always a quarter past three, and visitors
          laughed when they checked their watches. One spring a young clockmaker climbed the tower with a bag
          of tools, and by the evening the bells were ringing again for the first time in decades. The people
          came out of their houses to listen, and some of the older ones cried. The next morning the baker put
          a small cake in the shape of a clock in his window, and the mayor promised that the town would pay
          someone to wind the clock every Sunday from then on. The clockmaker was given the keys to the tower
          and a free lunch at the inn whenever she liked."""),
    prose("""Before you start the installation, make sure your computer has at least eight gigabytes of memory
          and twenty gigabytes of free disk space. Download the installer from the official website, open it,
          and follow the instructions on the screen. When you are asked to choose a location, keep the default
          folder unless you have a good reason to change it. Restart the computer when the installation is
          complete. After the restart, open the program and sign in with the account you created when you
          bought the licence. The first start can take a few minutes while the program builds its index. If it
          does not start at all, run the installer again and choose the repair option. You can also find
          answers to common questions in the help section of the website."""),
    """function debounce(fn, wait) {
  let timer = null;
  return function (...args) {
    clearTimeout(timer);
    timer = setTimeout(() => {
      timer = null;
      fn.apply(this, args);
    }, wait);
  };
}

function throttle(fn, interval) {
  let last = 0;
  return function (...args) {
    const now = Date.now();
    if (now - last >= interval) {
      last = now;
      fn.apply(this, args);
    }
  };
}

const onResize = debounce(() => console.log(window.innerWidth), 200);
const onScroll = throttle(() => console.log(window.scrollY), 100);
window.addEventListener('resize', onResize);
window.addEventListener('scroll', onScroll);""",
    prose("""The river rises in the hills to the north, where the rain falls almost every day of the year. It
          runs south through deep valleys and small farming villages, widening as other streams join it, until
          it reaches the plain. There it slows down, curving back and forth across the flat land, and finally
          flows into the sea through a wide estuary full of birds. In spring, when the snow melts in the
          hills, the river often floods the fields along its banks, leaving behind a layer of rich mud. The
          farmers have learned to plant late, and in the autumn they bring their harvest to the market town by
          the old stone bridge. On market days the bridge is so crowded with carts and people that it can take
          half an hour to cross it."""),
    prose("""Minutes of the team meeting. Present: Anna, Ben, Carlos and Dana. Anna reported that the testing
          phase is two days behind schedule because of a problem with the database server. Ben will contact
          the supplier today. Carlos presented the new design for the login page, which the team approved.
          Dana reminded everyone that holiday requests must be submitted by Friday. Ben asked whether the
          release date can still be kept; the team agreed to decide next week, once the supplier has answered.
          Carlos will prepare a short demonstration for the customer visit on the twelfth. The next meeting
          will be on Monday at ten o'clock in the small conference room. Anna will send the updated schedule
          to everyone before then, and Dana will book the room."""),
    prose("""To change a flat tyre, first park the car on level ground and put the handbrake on. Loosen the wheel
          nuts slightly while the wheel is still on the ground. Lift the car with the jack until the tyre is
          off the ground, remove the nuts and pull the wheel off. Fit the spare wheel, tighten the nuts by
          hand, lower the car and then tighten the nuts fully in a cross pattern. Check the pressure of the
          spare tyre as soon as you can, because spare tyres often lose air while they are stored. Put the
          flat tyre and the tools back in the boot, and have the tyre repaired or replaced at a garage before
          your next long journey. Never drive fast on a spare tyre."""),
    """#include <stdio.h>

int main(void) {
    int numbers[] = {4, 8, 15, 16, 23, 42};
    int count = sizeof(numbers) / sizeof(numbers[0]);
    int sum = 0;
    for (int i = 0; i < count; i++) {
        sum += numbers[i];
    }
    printf("sum = %d, mean = %.2f\\n", sum, (double)sum / count);
    int largest = numbers[0];
    for (int i = 1; i < count; i++) {
        if (numbers[i] > largest) {
            largest = numbers[i];
        }
    }
    printf("largest = %d\\n", largest);
    return 0;
}""",
)


def main() -> None:
    tokenizer = load_chat_tokenizer(resolve_model_dir(None))
    prompts, token_ids = [], []
    for instruction in INSTRUCTIONS:
        for passage in PASSAGES:
            passage_tokens = len(tokenizer.encode(passage, add_special_tokens=False))
            if passage_tokens <= MAX_NEW_TOKENS + 8:
                raise SystemExit(f"a passage of {passage_tokens} tokens is too short for {MAX_NEW_TOKENS}: "
                                 f"{passage[:40]!r}")
            messages = [{"role": "user", "content": f"{instruction}\n\n{passage}"}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prompts.append(text)
            token_ids.append(tokenizer.encode(text, add_special_tokens=False))
    workload = {
        "description": (
            "Overlap workload for speculative decoding, for the embedded SmolLM2-135M-Instruct: 64 "
            "chat-templated prompts asking the model to repeat, quote, correct or copy one of 16 given "
            "passages (prose, a letter, minutes, instructions, Python, JavaScript, C and SQL), each longer "
            f"than {MAX_NEW_TOKENS} tokens, so that a faithful answer is inside its passage for every output "
            f"token; greedy, exactly {MAX_NEW_TOKENS} output tokens each with EOS ignored; plus one "
            "single-request latency case. Token ids are from the model's own tokenizer. Built by "
            "benchmarks/build_overlap_workload.py."),
        "n_requests": len(prompts), "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True, "temperature": 0.0,
        "prompts": prompts, "prompt_token_ids": token_ids,
        "latency_prompt": prompts[0], "latency_prompt_token_ids": token_ids[0],
    }
    OUT.write_text(json.dumps(workload, indent=1) + "\n")
    print(f"{OUT}: {len(prompts)} prompts, {min(map(len, token_ids))}-{max(map(len, token_ids))} tokens")


if __name__ == "__main__":
    main()
